"""Fake upstreams, fake programs and the scripts that run them."""
