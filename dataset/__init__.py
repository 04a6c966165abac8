"""scratchd.dataset"""
