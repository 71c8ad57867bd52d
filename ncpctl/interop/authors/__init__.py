"""Model directories in the layouts of the papers' own code (issue 43): one module per authors' code."""
