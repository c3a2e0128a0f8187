"""A request body taken in: read within bounds, decoded, parsed, shape-checked, costed,
held within budgets, and the record (``RoutedRequest``) every later stage reads."""
