"""DGR planning automation: prd.json model, validator, projections, story runner, evidence site."""
