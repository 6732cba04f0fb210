"""An example user project: a task outside the toolkit, in its own package."""
