//! Model configs and architectures.
