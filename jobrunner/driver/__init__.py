"""jobrunner.driver"""
