"""jobrunner.io"""
