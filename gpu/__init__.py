"""scratchd.gpu"""
