"""The build side: image sources, layer entries, chunking, index building and publishing."""
