"""The designs: one room (package) each, declared once by its ``SPEC`` (a ``DesignSpec``)."""
