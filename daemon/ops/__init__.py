"""scratchd.daemon.ops"""
