"""fastdiff profile: per-kernel FLOP/byte counts, measured ceilings and a roofline of one U-Net step; for text-to-image
models also the time of one image split into text encoder, U-Net loop and VAE decode (``profile.text_to_image``)."""
