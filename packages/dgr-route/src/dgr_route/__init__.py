"""DGR route: the dgr.v1 wire (generated from proto/, never edited) and the boundary codec."""
