"""The engine's C++ kernels (csrc/) and their loader: a leaf that imports nothing from core.

loader.extension() builds the extension on first use and loads it; the model side
(core/model/linear.py, core/model/native_decoder.py) decides what to run with it.
"""
