"""SLURM support: render job templates for a layout, and place ranks on nodes."""
