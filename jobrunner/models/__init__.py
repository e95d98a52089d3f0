"""jobrunner.models"""
