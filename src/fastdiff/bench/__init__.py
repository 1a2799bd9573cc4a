"""fastdiff.bench."""
