"""scratchd.daemon"""
