"""Training modes over mpidist's collectives."""
