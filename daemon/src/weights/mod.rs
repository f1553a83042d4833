//! Checkpoint readers.
