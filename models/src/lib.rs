//! Kiln's bundled models.
