"""fastdiff.train."""
