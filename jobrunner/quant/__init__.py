"""jobrunner.quant"""
