"""scratchd.kernels"""
