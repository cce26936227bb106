"""Bundled calibration data: ``sentences.txt`` holds one English sentence per line."""
