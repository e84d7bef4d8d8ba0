"""Tracker inputs (DGR-050, 051, 055): what a DGR worker tells the Meshnet tracker.

The tracker's routing, load balancing, billing, telemetry, relay and provider semantics are not
DGR's (seed scope): these models carry exact inputs only, and a contract test keeps it so.
"""
