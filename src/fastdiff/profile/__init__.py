"""fastdiff profile: per-kernel FLOP/byte counts, measured ceilings and a roofline of one U-Net step."""
