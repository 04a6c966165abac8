"""scratchd.daemon.kserve"""
