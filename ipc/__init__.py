"""scratchd.ipc"""
