"""kvik's AMD platform: MI300X (CDNA3) and other CDNA parts."""
