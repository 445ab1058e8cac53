"""One-off measurements behind the committed records in docs/, run from the repository root as
`python -m experiments.<name>`; experiments/README.md says which record each writes."""
