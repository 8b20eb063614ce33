"""kvik's model definitions, registered through the ``kvik_register_models`` hook."""
