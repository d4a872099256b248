"""The coordinator: workers join it, job owners submit to it, it plans and drives jobs."""
