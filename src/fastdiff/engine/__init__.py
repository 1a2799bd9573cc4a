"""fastdiff.engine."""
