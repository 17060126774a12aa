"""The ``Accelerator`` facade: its constructor options and the method groups it is built from."""
