"""scratchd.protocol"""
