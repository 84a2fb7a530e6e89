"""assembly"""
