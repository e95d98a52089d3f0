"""jobrunner.reports"""
