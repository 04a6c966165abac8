"""scratchd.daemon.frontend"""
