"""Graph passes that carry out a Plan."""
