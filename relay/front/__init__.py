"""front"""
