"""NumPy float64 transcriptions of reference frameworks' off-policy correction code (verl, SkyRL, slime, AReaL)."""
