"""scratchd.workers"""
