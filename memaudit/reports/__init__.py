"""The privacy report: report.json (schema-versioned) and its HTML and Markdown renderings."""
