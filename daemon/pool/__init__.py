"""scratchd.daemon.pool"""
