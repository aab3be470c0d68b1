//! The CPU backend: the reference implementation every other backend is checked against.
