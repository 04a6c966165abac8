"""scratchd.cpu"""
