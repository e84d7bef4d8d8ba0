"""DGR's wire: dgr.v1 (generated) and the boundary codec."""
