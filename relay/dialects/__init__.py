"""dialects"""
