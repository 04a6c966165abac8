"""scratchd.model"""
