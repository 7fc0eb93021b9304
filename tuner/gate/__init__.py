"""The accuracy gate: feeds built for the model (feeds) and the comparison that every
variant must pass before it is written, selected or served (verify). It fails closed."""
