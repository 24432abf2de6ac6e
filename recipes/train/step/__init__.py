"""The step: compiled on shapes, shown and checked, then built (`prepare`); whether it fits the device (`fit`);
`--recipe auto`'s inputs (`auto`)."""
