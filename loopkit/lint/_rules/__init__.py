"""The rules, one module per theme; ``.._registry`` collects every ``@rule`` declared here."""
