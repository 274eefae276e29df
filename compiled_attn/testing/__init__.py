"""Long-running checks of the library that tests and the device run share (not part of the API)."""
