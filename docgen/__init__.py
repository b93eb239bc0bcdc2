"""Pages of the documentation site made from the code at build time (mkdocs.yml's hook)."""
