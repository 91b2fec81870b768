"""Draft heads published for other engines (EAGLE-3 as the EAGLE authors, SpecForge and the
`speculators` library write them), served by the same EagleProposer as our own heads."""
